"""The planner: a measured profile of one worker, descriptions of devices and clusters, and the cost model
that predicts step time and scaling from them (see predict.py)."""
