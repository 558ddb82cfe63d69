// Building elements. Data always goes in as text (textContent, attributes), never as HTML.

/** An element with attributes, properties (`on*` listeners) and text or element children. */
export function el(tag, attributes = {}, ...children) {
  const element = document.createElement(tag);
  for (const [name, value] of Object.entries(attributes)) {
    if (value === undefined || value === null || value === false) continue;
    if (name.startsWith("on") && typeof value === "function") {
      element.addEventListener(name.slice(2), value);
    } else if (value === true) {
      element.setAttribute(name, "");
    } else {
      element.setAttribute(name, String(value));
    }
  }
  element.append(...children.flat().filter((child) => child !== null && child !== undefined)
    .map((child) => (child instanceof Node ? child : String(child))));
  return element;
}

/** Replace an element's children. */
export function replaceChildren(parent, ...children) {
  parent.replaceChildren(...children.flat().filter((child) => child !== null && child !== undefined));
}

/** A unix-ms time as the reader's local date and time; empty for none. */
export function formatTime(ms) {
  if (ms === null || ms === undefined || ms === 0) return "";
  return new Date(ms).toLocaleString();
}

const BINARY_UNITS = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];

/** A size in binary units people read: 512 B, 1.5 MiB, 200.0 MiB, 4.0 GiB; empty for none. */
export function formatBytes(size) {
  if (typeof size !== "number" || !Number.isFinite(size)) return "";
  if (size < 1024) return `${size} B`;
  let value = size;
  let unit = "";
  for (unit of BINARY_UNITS) {
    value /= 1024;
    if (value < 1024) break;
  }
  return `${value.toFixed(1)} ${unit}`;
}

/** CPU time to the hundredth of a second: 0.42 s, 1 min 1.25 s, 2 h 5 min 9 s; empty for none. */
export function formatCpuSeconds(seconds) {
  if (typeof seconds !== "number" || !Number.isFinite(seconds)) return "";
  if (seconds < 60) return `${seconds.toFixed(2)} s`;
  const minutes = Math.floor(seconds / 60);
  const rest = seconds - minutes * 60;
  if (minutes < 60) return `${minutes} min ${rest.toFixed(2)} s`;
  return `${Math.floor(minutes / 60)} h ${minutes % 60} min ${Math.floor(rest)} s`;
}

/** User and system CPU seconds of a job or an attempt together; null when neither was measured. */
export function cpuTotalSeconds(usage) {
  const parts = [usage.cpu_user_s, usage.cpu_system_s].filter((part) => typeof part === "number");
  return parts.length ? parts.reduce((sum, part) => sum + part, 0) : null;
}

/** Say something to screen-reader users without moving their focus. */
export function announce(text) {
  const announcer = document.getElementById("announcer");
  announcer.textContent = "";
  // A change of text is what a live region reads out; give the clear a frame first.
  requestAnimationFrame(() => { announcer.textContent = text; });
}

/** A status as a badge whose text is the status (colour is only a hint). */
export function statusBadge(status) {
  return el("span", { class: `status status-${String(status).toLowerCase()}` }, status);
}

/** Ask a yes/no question in the page's modal <dialog>; resolves true when confirmed. */
export function confirmAction({ title, text, confirmLabel }) {
  const dialog = document.getElementById("confirm-dialog");
  document.getElementById("confirm-title").textContent = title;
  document.getElementById("confirm-text").textContent = text;
  document.getElementById("confirm-button").textContent = confirmLabel;
  dialog.returnValue = "";
  return new Promise((resolve) => {
    dialog.addEventListener("close", () => resolve(dialog.returnValue === "confirm"), { once: true });
    dialog.showModal();
  });
}
