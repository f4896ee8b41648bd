"""`python -m tidal.plan`: what the planner's measurement processes run."""

from tidal.plan.command import main

main()
