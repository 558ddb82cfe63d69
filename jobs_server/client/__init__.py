"""The terminal client: `jobs-server submit|logs|list|status|stop|delete`.

A thin client on aiohttp that never imports Ray, pydantic or the server, so it starts fast:
`http` (the calls and the server's errors), `sse` (reading Server-Sent Events), `follow`
(following a log across dropped connections), `interrupt` (Ctrl-C while following),
`output` (what is printed) and `commands` (the subcommands).
"""
