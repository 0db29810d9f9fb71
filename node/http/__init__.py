"""The HTTP face of the node (aiohttp): the only part of the package that knows aiohttp's server."""
