"""The KV tier under the prefix cache: block copies to host memory and block files in a directory."""
