"""The torch reference platform (``platform.TorchPlatform``): every operation in torch operators, any device."""
