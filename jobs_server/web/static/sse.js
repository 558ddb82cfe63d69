// Server-Sent Events read from a fetch() body (EventSource cannot send an Authorization
// header), parsed as the HTML standard says, resumed with Last-Event-ID after a drop.

/** The events of an event-stream body: {type, data, id} (id: the last id seen, or null). */
export async function* parseEventStream(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  let type = "";
  let data = [];
  let lastId = null;
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value;
      // A line ends at CRLF, LF or CR; a CR at the end may be the first half of a CRLF.
      let match;
      while ((match = /\r\n|\n|\r(?=[^\n])/.exec(buffer)) !== null) {
        const line = buffer.slice(0, match.index);
        buffer = buffer.slice(match.index + match[0].length);
        if (line === "") {
          if (data.length > 0) yield { type: type || "message", data: data.join("\n"), id: lastId };
          type = "";
          data = [];
          continue;
        }
        if (line.startsWith(":")) continue; // a comment: heartbeats
        const colon = line.indexOf(":");
        const field = colon === -1 ? line : line.slice(0, colon);
        let value = colon === -1 ? "" : line.slice(colon + 1);
        if (value.startsWith(" ")) value = value.slice(1);
        if (field === "event") type = value;
        else if (field === "data") data.push(value);
        else if (field === "id" && !value.includes("\0")) lastId = value;
      }
    }
  } finally {
    reader.releaseLock();
  }
}

const RECONNECT_DELAY_MS = 1000;

/**
 * Follow an event stream until `signal` aborts or `onEvent` returns true (done).
 * `open(lastEventId)` makes the request (a fetch Response); after a dropped connection it is
 * called again with the last id seen, so the stream resumes where it stopped. A thrown
 * ApiError (4xx) ends the follow and is rethrown.
 */
export async function followEventStream({ open, onEvent, signal, lastEventId = null }) {
  let lastId = lastEventId;
  while (!signal.aborted) {
    let response;
    try {
      response = await open(lastId);
    } catch (error) {
      if (signal.aborted) return;
      if (error.status !== undefined) throw error;
      await sleep(RECONNECT_DELAY_MS, signal); // the network: try again
      continue;
    }
    try {
      for await (const event of parseEventStream(response.body)) {
        lastId = event.id;
        if (onEvent(event)) return;
      }
    } catch {
      if (signal.aborted) return;
    }
    await sleep(RECONNECT_DELAY_MS, signal);
  }
}

export function sleep(ms, signal) {
  return new Promise((resolve) => {
    const timer = setTimeout(resolve, ms);
    signal?.addEventListener("abort", () => { clearTimeout(timer); resolve(); }, { once: true });
  });
}
