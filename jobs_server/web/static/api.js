// The API, as this page calls it: the key from session storage as a bearer token, JSON errors
// turned into ApiError with the server's message.

const KEY_STORAGE_NAME = "jobs-server.key";

export class ApiError extends Error {
  constructor(status, code, message) {
    super(message);
    this.status = status;
    this.code = code;
  }

  /** The key is missing (401) or was rejected (403 forbidden). */
  get isAuthError() {
    return this.status === 401 || (this.status === 403 && this.code === "forbidden");
  }
}

export function authRequired() {
  return document.body.dataset.auth === "on";
}

export function storedKey() {
  return sessionStorage.getItem(KEY_STORAGE_NAME);
}

export function storeKey(key) {
  sessionStorage.setItem(KEY_STORAGE_NAME, key);
}

export function forgetKey() {
  sessionStorage.removeItem(KEY_STORAGE_NAME);
}

/** Headers every call carries: the key, when there is one. */
export function authHeaders(extra = {}) {
  const key = storedKey();
  return key ? { ...extra, Authorization: `Bearer ${key}` } : { ...extra };
}

/** fetch() with the key; throws ApiError for an answer that is not 2xx. */
export async function request(path, { method = "GET", headers = {}, body, signal } = {}) {
  const response = await fetch(path, {
    method,
    headers: authHeaders(headers),
    body,
    signal,
    cache: "no-store",
    credentials: "omit",
  });
  if (!response.ok) throw await errorOf(response);
  return response;
}

async function errorOf(response) {
  let code = "http_error";
  let message = `${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    code = body.error?.code ?? code;
    message = body.error?.message ?? message;
  } catch {
    // Not our JSON error (a proxy's page, say): the status line says enough.
  }
  return new ApiError(response.status, code, message);
}

export async function getJson(path, options) {
  return (await request(path, options)).json();
}

export async function sendJson(method, path, data) {
  const response = await request(path, {
    method,
    headers: { "Content-Type": "application/json" },
    body: data === undefined ? undefined : JSON.stringify(data),
  });
  return response.json();
}

export function jobPath(jobId) {
  return `/api/jobs/${encodeURIComponent(jobId)}`;
}

/** The `after` of a `Link: <...>; rel="next"` header, or null on the last page. */
export function nextAfter(response) {
  const link = response.headers.get("Link");
  if (!link) return null;
  for (const part of link.split(",")) {
    const match = part.match(/<([^>]*)>\s*;\s*rel="?next"?/);
    if (match) return new URL(match[1], location.href).searchParams.get("after");
  }
  return null;
}
