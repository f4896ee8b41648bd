"""`tidal bench rollout`, runnable from a checkout: the benchmark lives in tidal.bench.rollout."""

from tidal.bench.rollout import main

if __name__ == "__main__":
    main()
