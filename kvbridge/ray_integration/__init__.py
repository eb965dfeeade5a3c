"""Ray Serve request routing through Dynamo's router. Ray is imported only in this package."""
