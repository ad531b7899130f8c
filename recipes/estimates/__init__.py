"""A job's memory, disk and time, estimated before it runs."""
