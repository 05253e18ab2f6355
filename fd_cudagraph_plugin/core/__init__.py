"""What runs inside a FastDeploy worker. Imports nothing from ``fd_cudagraph_plugin.tools``."""
