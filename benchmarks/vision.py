"""`tidal bench vision`, runnable from a checkout: the benchmark lives in tidal.bench.vision."""

from tidal.bench.vision import main

if __name__ == "__main__":
    main()
