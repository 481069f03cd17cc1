"""Ray side: the engine replica deployment, request routing, autoscaling policy."""
