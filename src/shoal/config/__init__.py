"""The run config: the `shoal train` YAML schema, which collects each feature's own settings
(``TrainerConfig``, ``RemoteConfig``, ``PPOConfig``), and its loader."""
