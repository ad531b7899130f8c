"""Running a program: the runtime's steps, ExecuTorch's LLM runner, the static runner, profiles."""
