"""Processes and the admin's side of a federation: SuperLink/SuperNode launch, the ClientApp launch
gate and warm server, certificates, the Control API client, local federations and the demo."""
