"""The adapter format every room shares: PEFT files and their validation, references, and where adapter
bytes come from (the sources protocol). Imports nothing of ours but itself (and no JAX)."""
