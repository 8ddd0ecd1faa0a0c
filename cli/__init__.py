"""The command line: the top floor, the only room that may call both the compiler and the runner."""
