"""`tidal bench trl`, runnable from a checkout: the benchmark lives in tidal.bench.versus_trl (TRL is the `bench` extra)."""

from tidal.bench.versus_trl import main

if __name__ == "__main__":
    main()
