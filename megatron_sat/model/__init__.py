"""The six architectures as Megatron-Core layer specs: config, layers, attention, V1 and history transport."""
