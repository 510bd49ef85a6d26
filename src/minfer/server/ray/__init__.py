"""minfer.server.ray: `minfer serve --ray`, replicas of the app as a Ray Serve deployment."""
