"""The agent role: tasks in, single rollouts through the inference engine, trajectories out;
and the evaluator, the same rollouts on held-out tasks for each published policy version.
"""
