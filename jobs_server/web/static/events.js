// Live job changes: the server's event stream (/api/events), or polling where the server has
// none (404) or cannot serve it now (503: say, its job archive is off), so the page works
// either way.

import { ApiError, request } from "./api.js";
import { followEventStream, sleep } from "./sse.js";

export const POLL_INTERVAL_MS = 2000;

/**
 * Call `onChange(event)` for every job change until `signal` aborts: `event` is a JobEvent
 * ({type: submitted|status|deleted, submission_id, status, job, ...}), `{type: "reset"}` when the
 * stream lost its place (list again), or `{type: "poll"}` every POLL_INTERVAL_MS without a stream.
 */
export async function watchJobs({ submissionId = null, onChange, signal }) {
  const query = new URLSearchParams();
  if (submissionId) query.set("submission_id", submissionId);
  const url = `/api/events${query.size ? `?${query}` : ""}`;
  let opened = false;
  try {
    await followEventStream({
      signal,
      open: async (lastId) => {
        const response = await request(url, {
          signal,
          headers: { Accept: "text/event-stream", ...(lastId ? { "Last-Event-ID": lastId } : {}) },
        });
        // Reconnected with no id to resume from: changes in the gap are unknown, list again.
        if (opened && !lastId) onChange({ type: "reset" });
        opened = true;
        return response;
      },
      onEvent: (event) => {
        if (event.type === "job" || event.type === "reset") onChange(JSON.parse(event.data));
        return false;
      },
    });
  } catch (error) {
    if (!(error instanceof ApiError) || error.isAuthError) throw error;
    while (!signal.aborted) {
      await sleep(POLL_INTERVAL_MS, signal);
      if (!signal.aborted) onChange({ type: "poll" });
    }
  }
}
