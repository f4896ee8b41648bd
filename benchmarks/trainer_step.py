"""`tidal bench trainer-step`, runnable from a checkout: the benchmark lives in tidal.bench.trainer_step."""

from tidal.bench.trainer_step import main

if __name__ == "__main__":
    main()
