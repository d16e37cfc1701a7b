"""The driver side: the executor, its runs and restarts, start-up, group calls, health, the
credit window, and the one place where Ray's errors become asyncexec's. Nothing here is imported
by a worker process."""
