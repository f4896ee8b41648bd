"""`tidal bench modes`, runnable from a checkout: the benchmark lives in tidal.bench.modes."""

from tidal.bench.modes import main

if __name__ == "__main__":
    main()
