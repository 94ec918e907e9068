"""The continuous learner's parts: sources, admission (staleness, de-duplication), batching, the update
step, weight publication, checkpoints, and the loop that joins them (`learner.trainer.loop.Trainer`)."""
