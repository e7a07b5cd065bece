"""The doors a job config comes in by: a TOML file, a Python config (``with_dmuon``); typed values for both."""
