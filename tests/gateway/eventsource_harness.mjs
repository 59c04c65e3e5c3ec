// A consumer of an SVC feed through the npm `eventsource` package, as integrators use it.
// Usage: node eventsource_harness.mjs URL KEY EVENT_TYPE
// Prints one JSON line per connection (with the Last-Event-ID it sent), per `cursor` frame
// and per event of EVENT_TYPE, then exits after the first such event. The first connection
// ends (as a dropped proxy connection would) once its first frame has come: the package
// then reconnects by itself, sending the last event id it kept.
import { EventSource } from "eventsource";

const [url, key, eventType] = process.argv.slice(2);
const say = (line) => process.stdout.write(JSON.stringify(line) + "\n");
let connections = 0;

function endingAfterFirstFrame(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let seen = "";
  const body = new ReadableStream({
    async pull(controller) {
      const { value, done } = await reader.read();
      if (done) {
        controller.close();
        return;
      }
      controller.enqueue(value);
      seen += decoder.decode(value, { stream: true });
      if (seen.includes("\n\n")) {
        await reader.cancel();
        controller.close();
        say({ kind: "cut" });
      }
    },
  });
  return new Response(body, { status: response.status, headers: response.headers });
}

const source = new EventSource(url, {
  fetch: async (input, init) => {
    connections += 1;
    say({ kind: "connect", lastEventId: init.headers["Last-Event-ID"] ?? null });
    const headers = { ...init.headers, Authorization: `Bearer ${key}` };
    const response = await fetch(input, { ...init, headers });
    return connections === 1 ? endingAfterFirstFrame(response) : response;
  },
});
source.addEventListener("cursor", (event) => say({ kind: "cursor", id: event.lastEventId }));
source.addEventListener(eventType, (event) => {
  say({ kind: "event", id: event.lastEventId });
  source.close();
  process.exit(0);
});
