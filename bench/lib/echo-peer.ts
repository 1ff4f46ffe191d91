/**
 * A responder process for hop benchmarks: registers with the relay through
 * the real RelayClient and answers every request with its own body and
 * headers (what a pass-through shard costs, minus compute).
 */
import { Identity } from '../../src/net/identity.ts';
import { RelayClient } from '../../src/net/relay-client.ts';
import { NodeWebSocketConstructor } from '../../src/host/node/socket.ts';

const relayUrl = process.argv[2];
if (!relayUrl) throw new Error('usage: echo-peer.ts <relay url>');
const client = new RelayClient({
  relayUrl,
  WebSocket: NodeWebSocketConstructor,
  identity: await Identity.generate(),
  handler: async (req) => ({ status: 200, headers: { 'x-meshnet-shape': req.headers['x-meshnet-shape'] ?? '', 'x-meshnet-dtype': 'bf16' }, body: req.body }),
});
client.start();
const reg = await client.ready(10_000);
process.stdout.write(`${JSON.stringify({ event: 'registered', peer_id: reg.peerId, relay_addr: reg.relayAddr })}\n`);
process.on('SIGTERM', () => {
  client.close();
  process.exit(0);
});
