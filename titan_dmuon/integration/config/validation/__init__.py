"""Every check of a DMuon job config before launch, one module per config section; ``validate.validate_dmuon`` runs
them all, for every door. Problems are ``naming.ConfigError`` lines."""
