"""The only code (with cluster/) on Ray's private API: the trainer, the controller, the torch
backend without torch, the scaling policies and the callbacks. A Ray upgrade is checked here."""
