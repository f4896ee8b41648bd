"""`tidal bench served-reward`, runnable from a checkout: the benchmark lives in tidal.bench.served_reward."""

from tidal.bench.served_reward import main

if __name__ == "__main__":
    main()
