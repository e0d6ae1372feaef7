"""vLLM engine processes: command lines, host allocation, process lifecycle."""
