"""The Ray Serve application: deployments and the builder."""
