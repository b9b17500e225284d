// A kvwake client in Node: net socket + @msgpack/msgpack, written from docs/protocol.md alone.
// usage: node client.mjs SOCKET SESSION_ID
// Prints one JSON object: each call's result (or error) and the streamed pieces of the generate call.
import net from "node:net";
import { once } from "node:events";
import { encode, decodeMultiStream } from "@msgpack/msgpack";

const [socketPath, sessionId] = process.argv.slice(2);
const sock = net.createConnection(socketPath);
await once(sock, "connect");
const messages = decodeMultiStream(sock)[Symbol.asyncIterator]();
let lastId = 0;

// One call at a time: send [0, msgid, method, params], collect [2, "stream", {msgid, text}]
// notifications for it, return at its response [1, msgid, error, result].
async function call(method, params, pieces = []) {
  const msgid = ++lastId;
  sock.write(encode([0, msgid, method, params]));
  for (;;) {
    const { value, done } = await messages.next();
    if (done) throw new Error(`connection closed during ${method}`);
    if (value[0] === 2 && value[1] === "stream" && value[2].msgid === msgid) pieces.push(value[2].text);
    else if (value[0] === 1 && value[1] === msgid) return { error: value[2], result: value[3] };
  }
}

const out = {};
out.hello = await call("hello", [{ client: "node", protocol: 1 }]); // params as the spec's array
out.create = await call("session.create", { session_id: sessionId, system: "You are terse." }); // or the map
out.append = await call("session.append", [{ session_id: sessionId, messages: [{ role: "user", content: "hi" }] }]);
const pieces = [];
out.generate = await call("session.generate", [{ session_id: sessionId, max_tokens: 12, stream: true }], pieces);
out.pieces = pieces;
out.sleep = await call("session.sleep", [{ session_id: sessionId }]);
out.wake = await call("session.wake", [{ session_id: sessionId }]);
out.info = await call("session.info", [{ session_id: sessionId }]);
out.error = await call("session.info", [{ session_id: "nobody-" + sessionId }]);
sock.end();
process.stdout.write(JSON.stringify(out));
