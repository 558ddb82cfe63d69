// The job list: a status filter, a search over ids and metadata, pages through the list API's
// `limit`/`after` and its Link header, rows that follow the event stream, and what each job
// used (peak memory, CPU time), by which the rows of the page on screen can be sorted.

import { nextAfter, request } from "./api.js";
import {
  cpuTotalSeconds, el, formatBytes, formatCpuSeconds, formatTime, replaceChildren, statusBadge,
} from "./dom.js";
import { watchJobs } from "./events.js";

export const PAGE_SIZE = 50;
const STATUSES = ["PENDING", "RUNNING", "SUCCEEDED", "FAILED", "STOPPED"];
// Many events in a burst (a hundred submissions) cause one reload, not a hundred.
const RELOAD_DEBOUNCE_MS = 200;
// The columns the rows can be sorted by: a job's value in each (null: not measured).
const SORT_KEYS = {
  "peak-memory": { label: "Peak memory", value: (job) => job.peak_memory_bytes ?? null },
  "cpu-time": { label: "CPU time", value: cpuTotalSeconds },
};

/** `jobs` in the server's order, or by `sort.key` (largest first unless ascending); jobs not
 * measured last either way, in the server's order. */
export function sortedJobs(jobs, sort) {
  if (!sort.key) return jobs;
  const value = SORT_KEYS[sort.key].value;
  const direction = sort.ascending ? 1 : -1;
  return [...jobs].sort((a, b) => {
    const [left, right] = [value(a), value(b)];
    if (left === null || right === null) return (left === null) - (right === null);
    return direction * (left - right);
  });
}

/** The list; `params` (from the address, `#/?status=RUNNING&limit=20`) set its first view. */
export function renderJobList(main, { signal, onError, params = new URLSearchParams() }) {
  const requestedLimit = Number(params.get("limit"));
  const state = {
    status: STATUSES.includes(params.get("status")) ? params.get("status") : "",
    search: params.get("search") ?? "",
    limit: Number.isInteger(requestedLimit) && requestedLimit > 0 ? requestedLimit : PAGE_SIZE,
    pageStarts: [null],
    sort: { key: null, ascending: false },
    jobs: [],
    next: null,
  };

  const statusFilter = el("select", { id: "status-filter", name: "status" },
    el("option", { value: "" }, "All"),
    STATUSES.map((status) => el("option", { value: status }, status)));
  const search = el("input", {
    id: "job-search", type: "search", name: "search", autocomplete: "off",
    placeholder: "text, or key=value",
  });
  const previous = el("button", { type: "button", id: "previous-page" }, "Previous page");
  const next = el("button", { type: "button", id: "next-page" }, "Next page");
  const pageLabel = el("span", { id: "page-label", "aria-live": "polite" });
  const body = el("tbody");
  // A sortable column's header is a button: a click sorts by it, largest first; again, smallest
  // first; a third time, back to the server's order.
  const sortHeaders = Object.entries(SORT_KEYS).map(([key, { label }]) => {
    const button = el("button", { type: "button", class: "sort", "data-sort": key }, label);
    button.addEventListener("click", () => {
      const { sort } = state;
      if (sort.key !== key) Object.assign(sort, { key, ascending: false });
      else if (!sort.ascending) sort.ascending = true;
      else Object.assign(sort, { key: null, ascending: false });
      render();
    });
    return el("th", { scope: "col", "data-sort-column": key }, button);
  });
  const table = el("table", { class: "jobs", "aria-describedby": "page-label" },
    el("caption", { class: "visually-hidden" }, "Jobs"),
    el("thead", {}, el("tr", {},
      ["Job", "Status", "Entrypoint", "Metadata", "Started", "Ended"]
        .map((name) => el("th", { scope: "col" }, name)),
      sortHeaders)),
    body);
  const empty = el("p", { class: "empty", hidden: true }, "No jobs.");
  statusFilter.value = state.status;
  search.value = state.search;

  replaceChildren(main,
    el("h1", {}, "Jobs"),
    el("form", { class: "filters", role: "search", onsubmit: (event) => event.preventDefault() },
      el("div", {}, el("label", { for: "status-filter" }, "Status"), statusFilter),
      el("div", {}, el("label", { for: "job-search" }, "Search id or metadata"), search)),
    table, empty,
    el("nav", { class: "pager", "aria-label": "Pages" }, previous, pageLabel, next));

  // `key=value` asks the server for the jobs with that metadata (every page); anything else
  // narrows the page on screen to ids, keys and values that contain it.
  function metadataFilter() {
    const match = state.search.trim().match(/^([^=\s]+)=(.*)$/);
    return match ? [match[1], match[2]] : null;
  }

  function matches(job) {
    const needle = state.search.trim().toLowerCase();
    if (!needle || metadataFilter()) return true;
    const haystack = [job.submission_id, ...Object.entries(job.metadata ?? {}).flat()];
    return haystack.some((text) => String(text).toLowerCase().includes(needle));
  }

  function row(job) {
    const link = el("a", { href: `#/jobs/${encodeURIComponent(job.submission_id)}` },
      job.submission_id);
    const metadata = Object.entries(job.metadata ?? {}).map(([key, value]) =>
      el("span", { class: "tag" }, `${key}=${value}`));
    return el("tr", { "data-job-id": job.submission_id },
      el("td", {}, link),
      el("td", { class: "status-cell" }, statusBadge(job.status)),
      el("td", {}, el("code", { class: "entrypoint" }, job.entrypoint)),
      el("td", {}, metadata),
      el("td", {}, formatTime(job.start_time)),
      el("td", {}, formatTime(job.end_time)),
      el("td", { "data-field": "peak-memory", class: "number" },
        formatBytes(job.peak_memory_bytes)),
      el("td", { "data-field": "cpu-time", class: "number" },
        formatCpuSeconds(cpuTotalSeconds(job))));
  }

  function render() {
    const shown = sortedJobs(state.jobs.filter(matches), state.sort);
    replaceChildren(body, shown.map(row));
    for (const header of sortHeaders) {
      if (header.dataset.sortColumn !== state.sort.key) header.removeAttribute("aria-sort");
      else header.setAttribute("aria-sort", state.sort.ascending ? "ascending" : "descending");
    }
    empty.hidden = shown.length > 0;
    const page = state.pageStarts.length;
    pageLabel.textContent = `Page ${page}, ${shown.length} of ${state.jobs.length} jobs shown`;
    previous.disabled = page === 1;
    next.disabled = state.next === null;
  }

  async function load() {
    const query = new URLSearchParams({ limit: String(state.limit) });
    if (state.status) query.set("status", state.status);
    const metadata = metadataFilter();
    if (metadata) query.set(`metadata.${metadata[0]}`, metadata[1]);
    const after = state.pageStarts[state.pageStarts.length - 1];
    if (after) query.set("after", after);
    try {
      const response = await request(`/api/jobs/?${query}`, { signal });
      state.jobs = await response.json();
      state.next = nextAfter(response);
      render();
    } catch (error) {
      if (!signal.aborted) onError(error);
    }
  }

  let reloadTimer = null;
  function reloadSoon() {
    clearTimeout(reloadTimer);
    reloadTimer = setTimeout(load, RELOAD_DEBOUNCE_MS);
  }
  signal.addEventListener("abort", () => clearTimeout(reloadTimer));

  function onChange(event) {
    const index = state.jobs.findIndex((job) => job.submission_id === event.submission_id);
    const fitsFilter = !state.status || event.status === state.status;
    if (event.type === "status" && event.job && index !== -1 && fitsFilter) {
      state.jobs[index] = event.job; // an update in place keeps the reader's place
      render();
    } else {
      reloadSoon(); // submitted, deleted, reset, a poll: what the page holds may have changed
    }
  }

  statusFilter.addEventListener("change", () => {
    state.status = statusFilter.value;
    state.pageStarts = [null];
    load();
  });
  search.addEventListener("input", () => {
    const askedServer = metadataFilter() !== null;
    state.search = search.value;
    if (askedServer || metadataFilter()) {
      state.pageStarts = [null];
      reloadSoon();
    } else {
      render();
    }
  });
  next.addEventListener("click", () => { state.pageStarts.push(state.next); load(); });
  previous.addEventListener("click", () => { state.pageStarts.pop(); load(); });

  load().then(() => watchJobs({ onChange, signal })).catch((error) => {
    if (!signal.aborted) onError(error);
  });
}

