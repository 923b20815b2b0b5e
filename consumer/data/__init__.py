"""Reading the trajectory stream into batches of complete GRPO groups: XREADGROUP, decoding, assembly."""
