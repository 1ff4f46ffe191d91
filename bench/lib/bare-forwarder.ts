/**
 * The floor for a relay hop: a `ws` server that forwards each binary message
 * from the "caller" socket to the "echo" socket and back, with no ids, no
 * registration, no limits. `bench/relay-hop` runs it side by side with the
 * real relay so the relay's own cost shows as a ratio on the same machine.
 *
 *   node --import tsx bench/lib/bare-forwarder.ts            → prints {"port":N}
 *   node --import tsx bench/lib/bare-forwarder.ts echo URL   → an echo client
 */
import { WebSocket, WebSocketServer } from 'ws';

if (process.argv[2] === 'echo') {
  const ws = new WebSocket(process.argv[3]!);
  ws.on('open', () => {
    ws.send('echo');
    process.stdout.write(`${JSON.stringify({ event: 'ready' })}\n`);
  });
  ws.on('message', (d, isBinary) => {
    if (isBinary) ws.send(d, { binary: true });
  });
} else {
  const wss = new WebSocketServer({ port: 0, host: '127.0.0.1', perMessageDeflate: false });
  let caller: WebSocket | null = null;
  let echo: WebSocket | null = null;
  wss.on('connection', (ws) => {
    ws.once('message', (role) => {
      if (String(role) === 'echo') echo = ws;
      else caller = ws;
      ws.on('message', (d, isBinary) => {
        if (!isBinary) return;
        const to = ws === caller ? echo : caller;
        to?.send(d, { binary: true });
      });
    });
  });
  wss.on('listening', () => process.stdout.write(`${JSON.stringify({ port: (wss.address() as { port: number }).port })}\n`));
  process.on('SIGTERM', () => process.exit(0));
}
