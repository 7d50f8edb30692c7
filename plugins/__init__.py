"""The in-tree backend plugins. Each is found through the ``polyaccel.plugins`` entry points."""
