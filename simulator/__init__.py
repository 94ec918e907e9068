"""The drift simulator: task families and verifiers (`families`), the environment agents talk to (`env`),
drift schedules and scenario files (`drift`, `scenario`, `generator`), sinks, replay, warm-start data."""
