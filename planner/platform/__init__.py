"""What the profilers, the runtime and the commands all stand on: starting local worker processes
and picking their backend and device (`launch.py`), the emulated slow link between them
(`link.py`), and timing a call on a device (`timing.py`)."""
