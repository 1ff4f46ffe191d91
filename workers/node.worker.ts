/**
 * The browser host of the node core, exposed to the page with Comlink.
 * Everything lives in src/host/browser/; this file only builds it and attaches it.
 */
import { expose } from 'comlink';
import { BrowserNode } from '../src/host/browser/index.ts';
import '../src/host/browser/transfer.ts';

// ORT's pthread workers are named em-pthread*; should one ever load this chunk, it must not start a second node.
if (!self.name.startsWith('em-pthread')) expose(new BrowserNode());
