"""`tidal bench shared-prompt`, runnable from a checkout: the benchmark lives in tidal.bench.shared_prompt."""

from tidal.bench.shared_prompt import main

if __name__ == "__main__":
    main()
