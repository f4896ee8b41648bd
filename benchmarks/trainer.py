"""`tidal bench trainer`, runnable from a checkout: the benchmark lives in tidal.bench.trainer."""

from tidal.bench.trainer import main

if __name__ == "__main__":
    main()
