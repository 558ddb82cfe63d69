"""What the HTTP side shares around the routes: the middlewares (errors as JSON, Host and
cross-site checks), where a request comes from, reading bodies and query parameters, ending a
stream cleanly, the upload budget, and the cache of finished jobs' JSON."""
