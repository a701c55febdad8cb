"""Department node side: the ClientApp, local training, data partitions and the model registry."""
