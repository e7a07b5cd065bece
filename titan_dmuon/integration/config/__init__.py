"""A TorchTitan job config as DMuon's: the doors it comes in by (a TOML file, ``with_dmuon``), the typed values,
every check before launch (one module per config section under ``validation``), the last steps before a build.
"""
