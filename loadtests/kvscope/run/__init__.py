"""Stage 3, running: workloads, the Locust user, streamed answers into records, the bench's treatments."""
