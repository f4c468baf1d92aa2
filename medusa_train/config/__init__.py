"""The configuration every entry point composes: the structured schemas (:mod:`.schema`), their numeric bounds
(:mod:`.bounds`), the dtype rule (:mod:`.precision`), the trainer preset ``trainer=auto`` picks
(:mod:`.auto_trainer`) and the renamed names that keep working with a warning
(:mod:`.renames`)."""
