"""`mleng mcp`: the handbook, the specs, the stored results and the measurements as MCP tools for AI agents."""
