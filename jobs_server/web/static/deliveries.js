// A job's webhook deliveries (issue 36, `GET /api/jobs/{id}/deliveries`): each event sent to
// each target, its state, its attempts and how the last one went. A server without webhooks
// answers 404: the section stays hidden.

import { ApiError, getJson, jobPath } from "./api.js";
import { el, formatTime, replaceChildren } from "./dom.js";

const COLUMNS = [
  ["event", "Event"], ["url", "Target"], ["state", "State"], ["attempts", "Attempts"],
  ["last-status", "Last status"], ["last-error", "Last error"], ["next-attempt", "Next attempt"],
  ["delivered", "Delivered"],
];

/** The job's deliveries, oldest first; null from a server without them (404). */
export async function readDeliveries(jobId, signal) {
  try {
    return (await getJson(`${jobPath(jobId)}/deliveries`, { signal })).deliveries;
  } catch (failure) {
    if (failure instanceof ApiError && failure.status === 404) return null;
    throw failure;
  }
}

/** Whether one is still to be tried again (its row changes with no event of the job's). */
export function anyPending(deliveries) {
  return (deliveries ?? []).some((delivery) => delivery.state === "pending");
}

/** The "Webhook deliveries" section: hidden when there are none. */
export function renderDeliveries(section, deliveries) {
  section.hidden = !deliveries?.length;
  if (section.hidden) return;
  const rows = deliveries.map((delivery) => {
    const values = {
      event: delivery.event_type,
      url: delivery.url,
      state: delivery.state,
      attempts: delivery.attempts,
      "last-status": delivery.last_status_code ?? "",
      "last-error": delivery.last_error ?? "", // as text: a receiver's words are never run
      "next-attempt": formatTime(delivery.next_attempt_at),
      delivered: formatTime(delivery.delivered_at),
    };
    return el("tr", { "data-delivery-id": delivery.id },
      COLUMNS.map(([field]) => el("td", { "data-field": field }, values[field])));
  });
  replaceChildren(section,
    el("h2", { id: "deliveries-title" }, "Webhook deliveries"),
    el("table", { class: "jobs deliveries" },
      el("thead", {}, el("tr", {}, COLUMNS.map(([, name]) => el("th", { scope: "col" }, name)))),
      el("tbody", {}, rows)));
}
