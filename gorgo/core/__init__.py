"""Pure routing core: no I/O, no clock of its own; shared by the live server and the simulator."""
