"""The demo's own models, apart from the runtime: the tiny model built from a config (`tiny`), its warm
starts (`warm_start`: SFT on the synthetic tasks, cached), the synthetic tool-use traces they play
(`tool_traces`) and the built-in tiny reward model (`reward_model`). Nothing else of Tidal needs them
to train a real model; they let every example and test run on a CPU with nothing downloaded."""
