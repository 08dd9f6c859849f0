"""What users run on a trained draft, for any registered family: load a checkpoint, export it, validate
an export, evaluate it by real speculative decoding. Families are found through the registry."""
